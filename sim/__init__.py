"""The served system in virtual time (issue 61): the production router, verifier replicas and
the edge's pacing on a simulated clock, with only the target forward, the drafts and the network
modelled. See docs/simulation.md."""
