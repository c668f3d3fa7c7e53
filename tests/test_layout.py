"""The tree keeps its shape: no import circle in the product code, layers that import only
downwards (shard_engine -> loaders -> server), and ``server.config`` importing nothing of the server
(every part of the server reads its options from there). Read from the source: nothing is imported."""

from tests.layout import cycles, graph

LAYERS = ("shard_engine", "loaders", "server")


def test_no_import_circle():
    assert cycles(graph()) == []


def test_cycles_are_found():  # the check itself can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_import_only_downwards():
    wrong = []
    for module, imported in graph().items():
        layer = LAYERS.index(module.split(".")[0])
        wrong += [(module, other) for other in imported if LAYERS.index(other.split(".")[0]) > layer]
    assert wrong == []


def test_config_imports_nothing_of_the_server():
    assert {m for m in graph()["server.config"] if m.startswith("server")} == set()
