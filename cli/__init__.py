"""The `tfps` command: the outermost layer, free to reach both the operator and the runtime."""
