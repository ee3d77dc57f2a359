"""What the daemon and its clients share: the error tree (``errors``), the wire models and name
rules (``protocol``), checksums (``integrity``), the persistent tier's layout (``layout``) and the
object stores behind it (``objectstore``), and the decoding of a daemon's HTTP answers (``http``).

Torch-free and free of both sides' code: the daemon imports this package, never
:mod:`tierckpt_client`, and the client never imports :mod:`tierckpt_daemon`.
"""
