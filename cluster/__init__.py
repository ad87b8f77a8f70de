"""Bringing raymoe up: YAML configs, placement groups, the CLI."""
