"""``python -m server`` and ``hsdp-serve``: the options first (``--help`` and a mistyped flag answer
at once: ``server.config`` imports no torch), then the ranks' fork server, so that its imports
(torch, transformers, the engine) overlap the launcher's own (``server.group.forkserver``)."""


def run() -> None:
    import sys

    from server.config import parse_serve_config

    cfg = parse_serve_config(sys.argv[1:])  # exits with the usage or the error
    from server.group.forkserver import start

    start()
    from server.main import main

    main(cfg=cfg)


if __name__ == "__main__":
    run()
