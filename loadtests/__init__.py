"""Load tests: thousands of simulated edge users against the Serve app (Locust).

``python -m loadtests.run`` is the one command; see ``loadtests/README.md``.
"""
