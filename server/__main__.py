"""``python -m server`` and ``hsdp-serve``: the ranks' fork server starts first, so that its imports
(torch, transformers, the engine) overlap the launcher's own (``server.group.forkserver``)."""


def run() -> None:
    from server.group.forkserver import start

    start()
    from server.main import main

    main()


if __name__ == "__main__":
    run()
