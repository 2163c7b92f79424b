"""Request metrics: counters and latency histograms in the Prometheus format.

Modules: `service` (the `spine.v1.Metrics` servicer and its collector), `config` (its config
section), `steps` (what the pipeline records for every finished request), `histograms` (metric
series as rows of device tensors, updated a micro-batch at a time), `prometheus_http` (the
loopback `GET /metrics` endpoint every process serves).
"""
