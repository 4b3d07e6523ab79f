"""The `flexmarl` command."""
