"""The command line (click only): each command's flags, its config, the library call, the
printing."""
