"""kvrail.operator"""
