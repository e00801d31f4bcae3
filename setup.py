"""A shim for tools that still call setup.py; everything lives in setup.cfg."""

from setuptools import setup

setup()
