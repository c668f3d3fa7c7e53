"""The HTTP APIs, one package per style, each its protocol (pydantic requests and responses) and
router: ``tgi`` (text-generation-inference: ``/generate``, ``/generate_stream``, ``/``), ``openai``
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, tool calling), and ``tokenize``
(``/tokenize`` in both shapes, ``/detokenize``). What they share with the engine lives in
``server.api.generation``; their error bodies in ``server.http.errors``.
"""
