"""One process: nothing to send; control values stay where they are."""
from __future__ import annotations

from typing import Any

from .base import Transport


class Local(Transport):
    name = "local"

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def gather(self, obj: Any) -> list | None:
        return [obj]

    def barrier(self) -> None:
        pass

    def any(self, flag: bool) -> bool:
        return bool(flag)
