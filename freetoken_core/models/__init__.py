"""Finding, converting and loading model weights."""
