"""kvrail.kernels"""
