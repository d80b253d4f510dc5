"""kvrail.router"""
