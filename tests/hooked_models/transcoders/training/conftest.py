import pytest

from hooked_models import HookedAlphaEr, HookedArcee


@pytest.fixture(scope="session")
def arcee():
    return HookedArcee.from_pretrained("embedded")


@pytest.fixture(scope="session")
def alpha_er():
    return HookedAlphaEr.from_pretrained("embedded")
