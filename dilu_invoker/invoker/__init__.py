"""invoker"""
