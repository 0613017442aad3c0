// The viewer's .npy reader (transformer-circuits.pub's npy_v0.js) has no package; graph and feature files
// here are JSON, so it is never called.
window.npyjs = {parse() { throw new Error("no .npy files are served here") }}
