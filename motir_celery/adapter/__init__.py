"""adapter"""
