"""The launcher: starts the coordinator and forks the logical ranks from a template with torch imported."""
