"""cache"""
