"""The command line (``batchspec <command>``); ``main`` is its entry point."""


def main(argv=None) -> int:
    from .commands import main as run

    return run(argv)
