"""The ``--order`` option of megac's commands: a bundled wave order by name
(``schedules/<name>.yaml``), or a wave-order YAML file of one's own, so an
order can be tried on the CPU (``megac schedule --order mine.yaml
--calibration h200-north-mini-code`` predicts its step) and then compiled,
benchmarked and served like a bundled one. Light on purpose: ``--help``
imports it."""

from __future__ import annotations

from pathlib import Path

import click

#: the bundled orders (megac.passes.order.ORDERS; repeated here so --help stays light)
ORDERS = ("tuned", "interleaved", "attention-first")


class OrderType(click.ParamType):
    """A bundled order's name, ``extra`` names (``all`` for bench), or the
    path of an existing ``.yaml`` / ``.yml`` file (returned absolute: the
    artifact cache keys on it and on its text)."""

    name = "order"

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.extra = tuple(extra)

    def get_metavar(self, param, ctx=None) -> str:  # noqa: ARG002 -- click's signature
        return "[" + "|".join((*ORDERS, *self.extra)) + "|FILE.yaml]"

    def convert(self, value, param, ctx):
        text = str(value)
        if text in ORDERS or text in self.extra:
            return text
        path = Path(text).expanduser()
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                self.fail(f"wave-order file {text} does not exist", param, ctx)
            return str(path.resolve())
        self.fail(f"{text!r} is neither a bundled order ({', '.join((*ORDERS, *self.extra))}) nor a "
                  f"wave-order .yaml file", param, ctx)


ORDER_HELP = ("Wave order: a bundled one (schedules/<order>.yaml) or a wave-order YAML file of your own "
              "(the format of schedules/tuned.yaml).")

__all__ = ["ORDERS", "ORDER_HELP", "OrderType"]
