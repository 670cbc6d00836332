"""The inference server around extraction: its kinds, the outage protocol, the host lock."""
