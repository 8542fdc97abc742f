"""`python -m cupygpt COMMAND` and the `cupygpt` command: the same commands as `python
cli.py`."""
import signal
import sys


def run():
    """The commands, with Ctrl-C during their imports (a second or so before each command
    installs its own handlers) a quiet exit 130 rather than an import's KeyboardInterrupt
    traceback. The streams are guarded before click writes anything itself (--help, a usage
    error): a standard output that fails there ends as a command's own output does
    (log.write_fd: a reader gone, quietly; no space or a closed stream, one line, exit 1)."""
    signal.signal(signal.SIGINT, lambda sig, frame: sys.exit(128 + sig))
    from .cli.main import main
    from .log import FAILED, guard_streams
    guard_streams()
    try:
        main()
    except SystemExit as e:
        if FAILED and e.code in (0, None):  # (a command's own entry has said so already)
            sys.exit(1)
        raise


if __name__ == "__main__":
    run()
