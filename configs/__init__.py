"""Starter configs shipped with hybridflow (installed as ``hybridflow.configs``); ``hybridflow init`` copies one."""
