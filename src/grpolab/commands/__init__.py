"""The commands: `grpolab <command>` and what they show."""
