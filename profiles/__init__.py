"""Bucket profiles shipped with cosytrt."""
