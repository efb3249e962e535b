"""MLflow: every engine recorded, registry versions and aliases, promotion with gates.

- ``tracking``: the client (``MLFLOW_TRACKING_URI`` or the embedded store at the project root),
  retries with backoff, names of experiments and registered models.
- ``publish``: one run per (model, SKU) manifest and a registered version of its engine; idempotent
  on the manifest digest.
- ``stats``: the noise-aware latency comparison (Mann-Whitney U and a bootstrap interval).
- ``gates``: promotion gates, one small function each, returning typed results.
- ``promotion``: moving aliases along the chain, the move history, rollback.
- ``releases``: versions and aliases per SKU.
- ``views``: how the experiments open in the MLflow UI (classic ML kind, a saved key-metrics view).

MLflow is imported inside functions only: importing this package stays cheap.
"""
