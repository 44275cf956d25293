"""Generated gRPC stubs for ``proto/tandem/v1`` (package ``tandem.v1``).

Regenerate with ``python -m services.api.generate`` after editing a ``.proto``;
``tests/unit/test_proto.py`` fails while the checked-in stubs are stale.
"""
