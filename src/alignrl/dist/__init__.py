"""Placement: process groups, torchrun launch."""
