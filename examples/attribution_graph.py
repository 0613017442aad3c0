"""An attribution graph of an IOI prompt on an embedded model: which transcoder features carry the answer.

    python examples/attribution_graph.py                    # the embedded Arcee, its shipped transcoders
    python examples/attribution_graph.py --family alpha_er
    python examples/attribution_graph.py --train 300        # train transcoders here instead (300 steps)

Loads (or trains) the model's transcoders, attributes the prompt (`hooked_models.attribution.attribute`),
prunes the graph, prints its scores and the strongest paths from the prompt's tokens to the answer's
logit, and writes the graph in circuit-tracer's JSON (its local viewer and Neuronpedia open it) and a
drawing: out/attribution_graph_<family>.json and .png.
"""

import argparse
import heapq
from pathlib import Path

import torch

from hooked_models.attribution import attribute
from hooked_models.embedded.task import make_ioi_prompts
from hooked_models.families import FAMILIES, load_model
from hooked_models.transcoders import TrainingConfig, load_transcoders, train_transcoders

PROMPT = "When Mary and John went to the store together, John gave a drink to"  # 16 tokens: alpha-er's block


def top_paths(graph, target: int, k: int = 5) -> list[tuple[float, list[int]]]:
    """The k paths into node `target` through the pruned graph with the largest product of edge shares
    (|weight| over the target's total |weight| in), from a node with no kept input (an embedding, or an
    error). Best first: extending a path only lowers its score, so the first k finished are the top k."""
    kept = graph.adjacency_matrix * graph.edge_mask
    share = kept.abs() / kept.abs().sum(1, keepdim=True).clamp(min=1e-30)
    heap, done = [(-1.0, [target])], []
    while heap and len(done) < k:
        negative, path = heapq.heappop(heap)
        sources = share[path[-1]].nonzero().flatten().tolist()
        if not sources:
            done.append((-negative, path[::-1]))
            continue
        for source in sources:
            heapq.heappush(heap, (negative * float(share[path[-1], source]), path + [source]))
    return done


def describe(graph, i: int, model) -> str:
    """A node's name with its token: the prompt's at its position, a logit's own."""
    if graph.node_kind(i) == "logit":
        token = model.tokenizer.decode([int(graph.logit_tokens[i - graph.logit_start])])
    else:
        token = graph.str_tokens[graph.node_position(i)[1]]
    return f"{graph.node_name(i)} ({token!r})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # alpha-er or alpha_er: either spelling, as everywhere a family is named
    parser.add_argument("--family", type=lambda name: name.replace("-", "_"), choices=FAMILIES, default="arcee")
    parser.add_argument("--train", type=int, default=0, metavar="STEPS",
                        help="train transcoders for this many steps instead of loading the shipped ones")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    model = load_model("embedded", args.family)
    if args.train:
        ioi = make_ioi_prompts(1024, 5)
        tokens = torch.cat([ioi.clean_tokens, ioi.corrupted_tokens])
        config = TrainingConfig(d_transcoder=256, activation="topk", k=16, steps=args.train, lr=3e-3)
        transcoders = train_transcoders(model, dataset=tokens, config=config)
    else:
        transcoders = load_transcoders("embedded", model=model)
    prompt = args.prompt
    graph = attribute(model, prompt, transcoders)
    pruned = graph.prune(node_threshold=0.8, edge_threshold=0.98)
    replacement, completeness = graph.scores()
    answer = pruned.logit_start  # the most probable logit comes first
    print(f"{args.family}: {graph.n_features} active features, {graph.n_nodes} nodes; pruned to "
          f"{int(pruned.node_mask.sum())} nodes, {int(pruned.edge_mask.sum())} edges")
    print(f"replacement score {replacement:.3f}, completeness score {completeness:.3f}")
    print(f"top logit: {describe(pruned, answer, model)} p={float(pruned.logit_probabilities[0]):.3f}")
    print("strongest paths to it (share of each edge in its target's input, multiplied):")
    for score, path in top_paths(pruned, answer):
        print(f"  {score:.3f}: " + " -> ".join(describe(pruned, i, model) for i in path))
    json_path = pruned.to_json(args.out / f"attribution_graph_{args.family}.json")
    png_path = args.out / f"attribution_graph_{args.family}.png"
    pruned.plot(png_path, title=f"{args.family}: {prompt!r}")
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
