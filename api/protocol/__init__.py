"""The protocol: request and response models, errors in the API's shape, per-choice inputs and their mapping onto
engine parameters. A leaf: every other api/ subpackage may import it; it imports none of them."""
