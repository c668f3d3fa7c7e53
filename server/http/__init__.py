"""HTTP plumbing on rank 0: the FastAPI app and its listener (``app``, ``listener``), connection
deadlines and caps (``connections``), access control and body limits (``guard``), one declaration of
every error body (``errors``), responses (``responses``), metrics (``metrics``), the server's state
(``state``) and the operator's page (``ui``). The APIs' routes live in ``server.api``."""
