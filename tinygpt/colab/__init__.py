"""colab"""
