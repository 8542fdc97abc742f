"""`python -m cupygpt COMMAND`: the same commands as `cupygpt` and `python cli.py`."""
from .cli import main

main()
