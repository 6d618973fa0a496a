"""The peers: the same workload on Procrastinate and on DBOS Transact.

These modules run inside ``bench/.peers-venv`` (made by ``bench.peersenv``),
never in the project's environment, and import nothing from motir_celery.
Each side is a small command that prints one JSON object on its last line.
"""
