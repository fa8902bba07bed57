"""loadbalancer"""
