"""What every app uses and that depends on no app: the environment readers, the metrics
registry, structured logging, bounded JSON input and the API's parser.

The bottom of the layering (tests/test_layers.py): `core` imports Django, DRF and third-party
libraries only, never an app and never `config`, which sits on top of everything.
"""
