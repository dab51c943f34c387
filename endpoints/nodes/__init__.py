"""The fleet's records: GPU nodes and join tokens (the Django app labelled `gpu_agent`), and the
notifications that wake a node's long poll or a held request. It depends on no other part of
`endpoints`; the fleet's operations (`endpoints.fleet`) and replicas (`endpoints.replicas`) build on it."""
