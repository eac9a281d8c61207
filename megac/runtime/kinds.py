"""The names ``--backend`` and ``--routing`` accept, in a module that imports
nothing: the command line builds its help from them, and ``megac --help``
must not wait for torch (about 2.5 s here) to print it."""

BACKEND_KINDS = ("cpu", "cuda", "auto", "reference", "graphs", "waves")
#: megac bench --routing (megac.routing_skew)
ROUTINGS = ("uniform", "skewed")

__all__ = ["BACKEND_KINDS", "ROUTINGS"]
