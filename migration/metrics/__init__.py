"""Where the gates' window stats come from: a Prometheus server (PromQL) or a direct scrape."""
