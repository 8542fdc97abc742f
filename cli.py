"""`python cli.py COMMAND` from a clone; an installed package has the `cupygpt` command."""
from cupygpt.__main__ import run

if __name__ == "__main__":
    run()
