"""`python cli.py COMMAND` from a clone; an installed package has the `cupygpt` command."""
from cupygpt.cli import main

if __name__ == "__main__":
    main()
