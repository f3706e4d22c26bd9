"""The tracker: node registry, route selection, sessions and billing records.

Today it holds the billing formula (shared with the gateway's ``billing.estimate`` telemetry);
registry, routing and persistence arrive with the route and tracker issues. Never imports torch.
"""
