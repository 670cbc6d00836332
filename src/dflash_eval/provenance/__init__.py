"""What a result depends on: model-file fingerprints and the stages' code."""
