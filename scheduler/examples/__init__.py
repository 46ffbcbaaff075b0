"""Example policies outside the built-in modes, loadable with `--policy MODULE:CLASS` (docs/policies.md)."""
