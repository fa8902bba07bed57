"""openwhisk"""
