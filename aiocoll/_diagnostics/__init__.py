"""Diagnostics that read a running engine: flight-recorder dumps in torch's format, ``[rank N]``
output.
"""
