"""The hidden-state cache on disk: shards, manifest and the resumable partial directory."""
