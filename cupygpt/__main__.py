"""`python -m cupygpt COMMAND` and the `cupygpt` command: the same commands as `python
cli.py`."""
import signal
import sys


def run():
    """The commands, with Ctrl-C during their imports (a second or so before each command
    installs its own handlers) a quiet exit 130 rather than an import's KeyboardInterrupt
    traceback."""
    signal.signal(signal.SIGINT, lambda sig, frame: sys.exit(128 + sig))
    from .cli.main import main
    main()


if __name__ == "__main__":
    run()
