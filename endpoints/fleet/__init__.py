"""Running the fleet: the API the GPU agents call (register, heartbeat, desired replicas, watch),
join tokens, cordon and drain, and the staff's fleet pages. It builds on the fleet's records
(`endpoints.nodes`) and on replicas (`endpoints.replicas`), and nothing in `endpoints` imports it:
only the project's URLs do. The agent program itself is `gpu_agent/` and shares only
`gpu_agent.protocol` with the control plane."""
