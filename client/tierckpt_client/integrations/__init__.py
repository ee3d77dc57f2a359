"""Integrations with training frameworks, one module each, each behind its own extra.

Nothing here is imported by ``tierckpt_client`` itself: ``import tierckpt_client`` stays free of
torch and of every framework. Import the module of the framework you use, e.g.
``from tierckpt_client.integrations.lightning import TieredModelParallelStrategy``
(``pip install 'tierckpt[client,lightning]'``).
"""
