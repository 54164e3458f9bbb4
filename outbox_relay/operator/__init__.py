"""What a person runs: the command line, the dead-row operations behind it and the web console."""
