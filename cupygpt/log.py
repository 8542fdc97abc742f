"""Per-rank output: one prefix and color per rank (pe0 blue, pe1 magenta, ...)."""
import click

COLORS = ("blue", "magenta", "cyan", "yellow", "green", "red", "bright_blue", "bright_magenta")


class Log:
    def __init__(self, rank=0, size=1):
        self.rank, self.size = rank, size

    def __call__(self, msg, every_rank=False, rank=0):
        """Prints on `rank` only (rank 0 unless told), or on every rank when every_rank."""
        if not every_rank and self.rank != rank:
            return
        if self.size > 1:
            tag = click.style(f"[pe{self.rank}]", fg=COLORS[self.rank % len(COLORS)])
            msg = "\n".join(f"{tag} {line}" for line in str(msg).split("\n"))
        click.echo(msg)
